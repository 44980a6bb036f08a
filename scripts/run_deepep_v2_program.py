"""Run DeepEP V2's own elastic test program (tests/elastic/test_ep.py) against our ElasticBuffer on CPU ranks.

Usage:
    python scripts/run_deepep_v2_program.py DEEPEP [--ranks 2 4] [--transports shm mooncake collective]
        [--scenarios default one-reduction] [--deterministic 0 1] [--timeout-s 900] [-- PROGRAM FLAGS...]

DEEPEP is a DeepEP checkout (a work tree, or a git directory such as the `fetch` tool's mirror, whose
HEAD's files are read with `git show` into a temporary folder outside this repository) or the path of
test_ep.py itself inside a checkout. Nothing of DeepEP is copied into this repository: its program and
its helpers (deep_ep/utils/*.py: refs, gate, math, envs, testing) are loaded from there at run time.

Each case is one run of the program, in its own process group (a subprocess of this script with a
deadline), with the program's own argparse reading: the scenario's flags, `--deterministic` or not,
`--num-processes R`, `--skip-perf-test` (its kineto benchmark profiles CUDA kernels by name), and the
sizes below (its defaults, 4096 tokens x 7168 hidden x 256 experts, are GPU sizes), then PROGRAM FLAGS.

What the shim changes at load time (and nothing else; the program's logic runs as written):
  * `deep_ep`: a module whose `ElasticBuffer` is ours (mooncake_ep_switch.elastic_buffer, with this
    runtime's `transport=` keyword set to the case's transport) and `topk_idx_t` ours (torch.int64);
    its `__path__` is the checkout's deep_ep/ folder, so `deep_ep.utils.*` are DeepEP's own files;
    `deep_ep._C` (the CUDA extension, imported by utils/envs.py, comm.py and event.py but not called on
    this path) is an empty stand-in with a placeholder `EventHandle`.
  * CUDA to CPU: a torch function mode turns `device='cuda'` (and `cuda:N`, `.cuda()`, `.to('cuda')`)
    into the CPU; `torch.set_default_device('cuda')`, `torch.cuda.set_device` and
    `torch.cuda.synchronize` do nothing; `torch.compile` returns the function (eager: same numbers).
  * torch.distributed: `init_process_group(backend='nccl', device_id=cuda)` becomes gloo without the
    device; `all_to_all_single` on float8 tensors moves their bytes as uint8 (gloo has no float8).
  * Launcher: the program's `torch.multiprocessing.spawn(test_loop, ...)` is called as written, but
    `spawn` runs our entry in each child (installs the shim, loads the program as a module, calls its
    `test_loop`); MASTER_PORT is a free port per case, WORLD_SIZE=1, RANK=0 (one host).
Prints one line per case: PASS/FAIL, the number of mode combinations the program ran, the seconds.
"""
import argparse
import contextlib
import functools
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types

SCENARIOS = {  # the two flag sets of V2's program (its defaults; the no-CPU-sync, one-reduction one)
    "default": ["--do-cpu-sync", "1", "--allow-hybrid-mode", "1", "--allow-multiple-reduction", "1"],
    "one-reduction": ["--do-cpu-sync", "0", "--allow-multiple-reduction", "0"],
}
SIZES = ["--num-tokens", "48", "--hidden", "256", "--num-topk", "6", "--num-experts", "16"]
PROGRAM = os.path.join("tests", "elastic", "test_ep.py")
UTILS = os.path.join("deep_ep", "utils")


# ---------------------------------------------------------------- the shim (in every process that loads the program)
def _cpu(device):
    """`device` with CUDA mapped to the CPU (other values unchanged)."""
    import torch
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _install_cuda_to_cpu():
    """Map the program's CUDA calls to the CPU (see the module docstring); returns the function mode."""
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
                args = (args[0], _cpu(args[1])) + tuple(args[2:])
            return func(*args, **kwargs)

    set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: set_default_device(_cpu(device))
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.compile = lambda fn=None, **kwargs: (fn if fn is not None else (lambda f: f))

    init_process_group = dist.init_process_group

    @functools.wraps(init_process_group)
    def gloo_init(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        kwargs.pop("device_id", None)
        return init_process_group(*args, **kwargs)

    dist.init_process_group = gloo_init
    all_to_all_single = dist.all_to_all_single

    @functools.wraps(all_to_all_single)
    def bytes_all_to_all(output, input, *args, **kwargs):
        if output.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            output, input = output.view(torch.uint8), input.view(torch.uint8)
        return all_to_all_single(output, input, *args, **kwargs)

    dist.all_to_all_single = bytes_all_to_all
    mode = CudaToCpu()
    mode.__enter__()
    return mode


def _install_deep_ep(deepep_root: str, transport: str):
    """Put a `deep_ep` module (our ElasticBuffer, DeepEP's own utils) into sys.modules."""
    import torch
    from mooncake_ep_switch.elastic_buffer import ElasticBuffer as Ours

    class ElasticBuffer(Ours):
        """Ours, with the case's transport (this runtime's keyword; V2's constructor has none)."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("transport", transport)
            super().__init__(*args, **kwargs)

    package = types.ModuleType("deep_ep")
    package.__path__ = [os.path.join(deepep_root, "deep_ep")]
    package.ElasticBuffer = ElasticBuffer
    package.topk_idx_t = torch.int64
    extension = types.ModuleType("deep_ep._C")
    extension.EventHandle = type("EventHandle", (), {})
    package._C = extension
    sys.modules["deep_ep"] = package
    sys.modules["deep_ep._C"] = extension


def _rank_main(local_rank, test_loop_name, program, deepep_root, transport, num_local_ranks, args):
    """Our entry in each spawned rank: the shim, the program as a module, its `test_loop`."""
    _install_cuda_to_cpu()
    _install_deep_ep(deepep_root, transport)
    namespace = runpy.run_path(program, run_name="deepep_v2_test_ep")
    namespace[test_loop_name](local_rank, num_local_ranks, args)


def run_case(program: str, deepep_root: str, transport: str, argv) -> None:
    """One run of the program (this process is its launcher): its __main__ block with its own argparse."""
    import torch.multiprocessing as mp
    _install_cuda_to_cpu()
    _install_deep_ep(deepep_root, transport)
    spawn = mp.spawn
    this_script = sys.modules["__main__"]

    def our_spawn(fn, args=(), nprocs=1, **kwargs):
        num_local_ranks, parsed = args
        program_main = sys.modules["__main__"]
        sys.modules["__main__"] = this_script  # the children import this script, not the program, as their main
        try:
            return spawn(_rank_main, args=(fn.__name__, program, deepep_root, transport, num_local_ranks, parsed),
                         nprocs=nprocs, **kwargs)
        finally:
            sys.modules["__main__"] = program_main

    mp.spawn = our_spawn
    sys.argv = [program] + list(argv)
    runpy.run_path(program, run_name="__main__")


# ---------------------------------------------------------------- the driver
def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _checkout(path: str, stack: contextlib.ExitStack):
    """(program path, DeepEP root, commit or None) of a work tree, a file in one, or a git directory."""
    if os.path.isfile(path):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path))))
        return os.path.abspath(path), root, None
    if os.path.isfile(os.path.join(path, PROGRAM)):
        return os.path.join(path, PROGRAM), os.path.abspath(path), None
    git = ["git", "--git-dir", path]
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    names = subprocess.run(git + ["ls-tree", "--name-only", "HEAD", UTILS + "/"], capture_output=True, text=True,
                           check=True).stdout.split()
    root = stack.enter_context(tempfile.TemporaryDirectory(prefix="deepep-"))
    for name in [PROGRAM] + [n for n in names if n.endswith(".py")]:
        os.makedirs(os.path.join(root, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(root, name), "wb") as out:
            out.write(subprocess.run(git + ["show", f"HEAD:{name}"], capture_output=True, check=True).stdout)
    return os.path.join(root, PROGRAM), root, commit


def _run_one(program, root, transport, argv, timeout_s):
    """Run a case in a new session with a deadline; (rc or None on timeout, output)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1", RANK="0")
    command = [sys.executable, os.path.abspath(__file__), "--case", program, root, transport, "--"] + argv
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this script started for the case
        output, _ = proc.communicate()
        return None, output
    except BaseException:  # interrupted (SIGTERM is turned into SystemExit by main): no rank left behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        program, root, transport = sys.argv[2:5]
        run_case(program, root, transport, sys.argv[6:])
        return 0
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("deepep", help="DeepEP checkout, git directory, or its tests/elastic/test_ep.py")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--transports", nargs="+", default=["shm"], choices=["shm", "mooncake", "collective"])
    parser.add_argument("--scenarios", nargs="+", default=sorted(SCENARIOS), choices=sorted(SCENARIOS))
    parser.add_argument("--deterministic", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    parser.add_argument("--timeout-s", type=float, default=900.0, help="deadline of one case")
    parser.add_argument("--log-dir", default=None, help="keep each case's output here")
    options = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    failures = 0
    with contextlib.ExitStack() as stack:
        program, root, commit = _checkout(options.deepep, stack)
        print(f"DeepEP V2 program: {program}" + (f" (commit {commit})" if commit else ""), flush=True)
        for num_ranks in options.ranks:
            for transport in options.transports:
                for scenario in options.scenarios:
                    for deterministic in options.deterministic:
                        case_argv = (["--num-processes", str(num_ranks), "--skip-perf-test"] + SIZES
                                     + SCENARIOS[scenario] + (["--deterministic"] if deterministic else []) + extra)
                        name = f"R={num_ranks} {transport} {scenario}{' --deterministic' if deterministic else ''}"
                        start = time.monotonic()
                        rc, output = _run_one(program, root, transport, case_argv, options.timeout_s)
                        modes = output.count(" > Testing with")
                        ok = rc == 0 and modes > 0
                        failures += not ok
                        status = "PASS" if ok else ("TIMEOUT" if rc is None else f"FAIL rc={rc}")
                        print(f"{status:12} {name}: {modes} modes, {time.monotonic() - start:.1f} s", flush=True)
                        if options.log_dir:
                            os.makedirs(options.log_dir, exist_ok=True)
                            with open(os.path.join(options.log_dir, name.replace(" ", "_") + ".log"), "w") as log:
                                log.write(" ".join(case_argv) + "\n" + output)
                        if not ok:
                            print("\n".join(output.splitlines()[-25:]), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
