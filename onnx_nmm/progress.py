"""How a long operation tells its caller what it is doing: phases with an optional total, advanced as work
finishes. `Progress()` hears nothing; the CLI shows it with rich progress bars."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Phase:
    """One phase of the work; `total` may be set or changed once known."""

    def set_total(self, total: int | None) -> None:
        pass

    def advance(self, amount: int = 1, detail: str | None = None) -> None:
        pass


class Progress:
    """The listener every long-running API function takes; subclass it to show progress."""

    @contextlib.contextmanager
    def phase(self, description: str, total: int | None = None) -> Iterator[Phase]:
        """A phase for the block it opens; one the block leaves by an exception (an error, ^C) did not finish,
        and a listener does not report it done."""
        yield Phase()
