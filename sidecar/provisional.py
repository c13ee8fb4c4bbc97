"""What the pipeline keeps while a transfer's pages are taken as written provisionally.

Decode's receiver can report success before the sender's last chunk is applied: its
record may trail (Mooncake's transfer thread), or, across pods, the prefill sidecar
publishes it to the shared ledger a little later. The pipeline then takes the
reserved pages as written, so decode's reads in the meantime raise nothing, and keeps
this snapshot to decide once the sender's facts arrive: the pages' gens and write
marks (to undo the provisional mark), and, for a read judged late, who had written
each page and who the reader was. If the sender sent less than was reserved and the
reader has ended by then (its row and pages released: under load a short request
finishes within the wait), the read it made is judged from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .events import ReadVerdict
from .request_directory import RequestInfo


@dataclass
class ProvisionalWrite:
    pages: np.ndarray  # the reserved row pages (page > 0), taken as written
    gens: np.ndarray  # their gens then
    written_gen: np.ndarray  # their write marks before the provisional mark (what is restored)
    row_index: np.ndarray  # each page's index in the reader's row
    last_writer: np.ndarray  # each page's last writer (request key) then
    reader: RequestInfo | None  # the receiving request

    def late_read_verdict(self, written_row_pages: np.ndarray) -> ReadVerdict | None:
        """The reader's read while it waited, once the sender's facts say which row pages
        the transfer wrote: a reserved page is unwritten if the transfer did not write it
        and nothing had written it in its current generation before (as the read judge
        rules). None when there is no reader to name or nothing was unwritten."""
        if self.reader is None:
            return None
        unwritten = ~np.isin(self.row_index, written_row_pages) & (self.written_gen != self.gens)
        if not unwritten.any():
            return None
        empty = np.zeros(0, np.int64)
        return ReadVerdict(
            self.reader, self.pages[unwritten], empty, empty, 0, unwritten_writers=self.last_writer[unwritten]
        )
