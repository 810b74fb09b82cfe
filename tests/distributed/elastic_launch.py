"""`ds-engine launch` for the elastic tests, with torchrun's rendezvous last call shortened.

    python tests/distributed/elastic_launch.py FIRST LATER LAUNCH_ARGS...

Once `--nnodes MIN` nodes have joined a c10d rendezvous round, torchrun waits its last call
(`last_call_timeout`, 30 s by default) for more nodes before it starts the group; the round
ends at once when `MAX` nodes have joined. FIRST is that wait in the launcher's first round,
LATER in every round after a restart (`--rdzv-conf last_call_timeout=N`, which ds-engine
launch does not pass through, sets one value for every round). Nothing else changes: the
launcher, torchrun's agent and its rendezvous are the real ones, run in this process as
`ds-engine launch` runs them.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from ds_engine.cli import main


def shorten_last_call(first: float, later: float) -> None:
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    original = handler.next_rendezvous
    rounds = 0

    def next_rendezvous(self: Any) -> Any:
        nonlocal rounds
        self._settings.timeout._last_call = timedelta(seconds=first if rounds == 0 else later)
        rounds += 1
        return original(self)

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


if __name__ == "__main__":
    first, later = float(sys.argv[1]), float(sys.argv[2])
    shorten_last_call(first, later)
    sys.exit(main(["launch", *sys.argv[3:]]))
