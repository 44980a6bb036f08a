"""The KV cache's published state: request records, and their int64 encoding peers read for a switch."""
from typing import Dict, List, NamedTuple, Tuple

import numpy as np

from mooncake_ep_switch.switch.kv_alloc import cdiv
from mooncake_ep_switch.layouts import EP, TP

_LAYOUT_CODE = {EP: 1, TP: 2}
_MAGIC = 0x4B56_4D45_5441  # "KVMETA"


class KVRequest(NamedTuple):
    """A request's KV state on this rank.

    Fields:
        num_tokens: tokens whose K/V are stored.
        prompt_len: prompt length (`num_tokens < prompt_len`: mid-prefill).
        pages: page ids (EP: EP page index; TP: unit index), `ceil(num_tokens / page_size)` of them.
    """

    num_tokens: int
    prompt_len: int
    pages: Tuple[int, ...]


class RankMeta(NamedTuple):
    """What a rank publishes for a switch: its layout, requests and free units."""

    layout: str
    requests: Dict[int, KVRequest]
    free: np.ndarray  # bool [num_units]


def encode_meta(meta: RankMeta, config) -> np.ndarray:
    """A rank's `RankMeta` as one int64 array (no pickle: peers read it from shared memory).

    Arguments:
        meta: the `RankMeta` (`PagedKVCache.snapshot()`).
        config: the cache's `KVCacheConfig`.

    Returns:
        data: `[n]` np.int64: header (magic, layout code, num_units, request count), then per
            request in rid order (rid, num_tokens, prompt_len, page count, page ids...), then the
            free-unit bitmap packed to bits and zero-padded to whole int64 words.
    """
    head = [_MAGIC, _LAYOUT_CODE[meta.layout], config.num_units, len(meta.requests)]
    body: List[int] = []
    for rid in sorted(meta.requests):
        req = meta.requests[rid]
        body += [rid, req.num_tokens, req.prompt_len, len(req.pages), *req.pages]
    bits = np.packbits(meta.free.astype(np.uint8))
    bits = np.concatenate([bits, np.zeros((-bits.size) % 8, dtype=np.uint8)]).view(np.int64)
    return np.concatenate([np.asarray(head + body, dtype=np.int64), bits])


def _check_pages(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rids: List[int],
                 num_pages: int) -> np.ndarray:
    """Every request's page ids (`data[starts[i]:starts[i] + lengths[i]]`, request `rids[i]`) inside
    `[0, num_pages)` and none twice in one request, all requests at once; the error names the first request
    (in record order) that breaks either, as a check request by request would.

    Returns:
        pages: `[sum(lengths)]` np.int64, every request's page ids, requests in record order.
    """
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    request = np.repeat(np.arange(lengths.size), lengths)                 # request index of every page entry
    pages = data[np.arange(total) - np.repeat(np.cumsum(lengths) - lengths - starts, lengths)]
    outside = (pages < 0) | (pages >= num_pages)
    first_bad = int(request[np.argmax(outside)]) if outside.any() else lengths.size
    # (request, page) as one sortable key; a page outside the range is clipped first (that request is reported
    # for it anyway, before any repeat of a later request)
    key = np.sort(request * (num_pages + 2) + (np.clip(pages, -1, num_pages) + 1))
    repeated = key[1:][key[1:] == key[:-1]]
    first_repeat = int(repeated.min()) // (num_pages + 2) if repeated.size else lengths.size
    if first_bad == lengths.size and first_repeat == lengths.size:
        return pages
    at = int(starts[min(first_bad, first_repeat)])
    mine = data[at:at + int(lengths[min(first_bad, first_repeat)])]
    rid = rids[min(first_bad, first_repeat)]
    if first_bad <= first_repeat:
        raise ValueError(f"metadata: request {rid} has a page id outside [0, {num_pages}) "
                         f"({int(mine.min())}..{int(mine.max())})")
    raise ValueError(f"metadata: request {rid} lists a page more than once ({mine.tolist()})")


def decode_meta(data: np.ndarray, config, num_ranks: int) -> RankMeta:
    """Inverse of `encode_meta`, validating what a peer published before any loop over it.

    Every count, length and page id is checked against the array's size and the cache's
    limits first, so corrupt metadata (a count of 2^40, a negative length, a page id past the
    pool) fails in time bounded by the array's size and never becomes an address.

    Arguments:
        data: `[n]` integer array as `encode_meta()` makes it (converted to np.int64).
        config: the reading cache's `KVCacheConfig` (the same on every rank).
        num_ranks: `P`.

    Returns:
        meta: a `RankMeta`.

    Raises:
        ValueError: ("metadata: ...") the magic, layout or `num_units` differ from this cache's, a
            request count or page count is negative or larger than the data holds, a request's
            page count is not `ceil(num_tokens / page_size)`, a page id is outside the layout's
            pages, a request id is negative or repeated, a token count is negative, or the
            data is truncated or has words after the free-unit bitmap.
    """
    try:
        data = np.asarray(data, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"metadata: expected an int64 array, got unreadable data ({error})") from None
    cfg = config
    units = cfg.num_units
    bitmap_words = cdiv(cdiv(units, 8), 8)
    if data.size < 4 + bitmap_words:
        raise ValueError(f"metadata: truncated: {data.size} words, a header and bitmap need {4 + bitmap_words}")
    if int(data[0]) != _MAGIC or int(data[2]) != units:
        raise ValueError("metadata: a peer published KV metadata of another shape or format "
                         f"(num_units {int(data[2])} vs {units})")
    layouts = {code: name for name, code in _LAYOUT_CODE.items()}
    if int(data[1]) not in layouts:
        raise ValueError(f"metadata: layout code {int(data[1])} is not one of {sorted(layouts)}")
    layout = layouts[int(data[1])]
    num_pages = units // num_ranks if layout == EP else units  # page ids of that layout
    end = data.size - bitmap_words
    count = int(data[3])
    if count < 0 or 4 + 4 * count > end:
        raise ValueError(f"metadata: request count {count} is negative or more than the {end - 4} words "
                         "of request records hold")
    page_size = cfg.page_size
    words = data[:end].tolist()  # Python ints: the record walk below reads them one by one
    at, requests = 4, {}
    starts, lengths, rids = [], [], []
    fault = ""  # the first record fault: raised after the pages of the records before it were checked
    for index in range(count):  # bounded: every record takes >= 4 of the `end` words
        if at + 4 > end:
            fault = f"metadata: truncated at request {index} of {count}"
            break
        rid, tokens, prompt, n = words[at:at + 4]
        if rid < 0 or rid in requests:
            fault = f"metadata: request id {rid} is negative or repeated"
        elif tokens < 0 or prompt < 0:
            fault = f"metadata: request {rid} has {tokens} tokens and prompt length {prompt}, expected >= 0"
        elif n < 0 or n > end - at - 4 or n > num_pages or n != cdiv(tokens, page_size):
            fault = (f"metadata: request {rid} lists {n} pages; expected ceil({tokens} tokens / {page_size}) "
                     f"within the {end - at - 4} words left and <= {num_pages} pages")
        if fault:
            break
        requests[rid] = KVRequest(tokens, prompt, tuple(words[at + 4:at + 4 + n]))
        starts.append(at + 4)
        lengths.append(n)
        rids.append(rid)
        at += 4 + n
    if not fault and at != end:
        fault = f"metadata: {end - at} words between the last request and the free-unit bitmap"
    # the pages of every record read (a fault among them is named first: it comes before `fault`)
    used = _check_pages(data, np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64), rids,
                        num_pages)
    if fault:
        raise ValueError(fault)
    free = np.unpackbits(data[end:].view(np.uint8))[:units].astype(bool)
    if layout == EP:
        used = (used[:, None] * num_ranks + np.arange(num_ranks)).reshape(-1)
    if used.size and free[used].any():
        raise ValueError(f"metadata: unit {int(used[free[used]][0])} is both in a request's pages and free")
    return RankMeta(layout, requests, free)
