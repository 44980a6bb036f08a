"""Test-only fault injection: a rank dies at a named point (set by `MEP_FAULT_POINT`).

The value is `point:rank:call:how` with `how` one of `exit` (os._exit), `kill` (SIGKILL) or `stop`
(SIGSTOP: the rank freezes until something sends it SIGCONT, a slow rank) and `call` a call number
or `*` for any. Points: `dispatch_after_data` (data written into peers, signals not yet),
`update_after_ready` (readiness for the next epoch posted, peers not mapped), and in the online
EPLB commit step (`call` = the chunk's epoch) `eplb_before_vote` (staged, vote not published),
`eplb_after_vote` (vote published, decision not read); in a grow (buffer/membership/grow.py, `call` unused)
`grow_build` (a member's build thread, before the new gloo group), `grow_before_vote` (a member whose build
finished, its GO not published), `grow_after_decision` (a member
that read the COMMIT, the switch-over step not written), `grow_weight_copy` (a newcomer past the members'
copies, its own not made) and `grow_before_switch` (a newcomer built, the switch-over step not read).
Unset in production: `FaultPoint.parse(None)` is None and nothing is checked.
"""
import os
import signal
from typing import NamedTuple, Optional


class FaultPoint(NamedTuple):
    """Where and how a rank dies.

    Fields:
        point: the point name.
        rank: the rank that dies there.
        call: call number (-1 = any).
        how: "exit", "kill" or "stop".
    """

    point: str
    rank: int
    call: int
    how: str

    @staticmethod
    def parse(text: Optional[str]) -> Optional["FaultPoint"]:
        """Parse `point:rank:call:how`, or return None for an unset setting.

        Arguments:
            text: the `MEP_FAULT_POINT` value, or None / "" when unset.

        Returns:
            fault: a `FaultPoint` (`call` -1 for `*`), or None when `text` is empty.

        Raises:
            ValueError: not four `:`-separated fields, `how` not exit/kill/stop, or a non-integer rank/call.
        """
        if not text:
            return None
        parts = text.split(":")
        if len(parts) != 4 or parts[3] not in ("exit", "kill", "stop"):
            raise ValueError(f"MEP_FAULT_POINT: expected point:rank:call:exit|kill|stop, got {text!r}")
        return FaultPoint(parts[0], int(parts[1]), -1 if parts[2] == "*" else int(parts[2]), parts[3])

    def hit(self, point: str, rank: int, call: int = -1) -> None:
        """Die (or freeze) here if this is the configured point, rank and call.

        Exits with `os._exit(17)` (`how="exit"`), SIGKILLs this process (`how="kill"`) or SIGSTOPs it
        (`how="stop"`: it resumes here when another process sends SIGCONT); returns normally otherwise.

        Arguments:
            point: name of the point reached.
            rank: this rank.
            call: current call number (matched unless the fault says any call).
        """
        if self.point == point and self.rank == rank and self.call in (-1, call):
            if self.how == "exit":
                os._exit(17)
            os.kill(os.getpid(), signal.SIGSTOP if self.how == "stop" else signal.SIGKILL)
