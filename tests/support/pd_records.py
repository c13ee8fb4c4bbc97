"""A prefill/decode request as the engine-side probes write it, for the sidecar tests (page
size 4): ``slots`` of pages, ``pd_request`` (decode reserves, prefill sends ``sent_tokens``,
decode reads the row) and ``finish`` (the request ends and decode frees its pages)."""

from __future__ import annotations

import numpy as np


def slots(pages):
    return np.concatenate([np.arange(p * 4, p * 4 + 4) for p in pages])


def pd_request(prefill, decode, rid, tenant, room, dst_pages, tokens, sent_tokens, src_page=50):
    for p in (prefill, decode):
        p.request_begin(rid, tenant, room, tokens, 0, False)
    decode.pages_allocated(slots(dst_pages))
    decode.rows_assigned(rid, 0, tokens, 0, slots(dst_pages)[:tokens])
    decode.transfer_reserved(rid, room, tokens, slots(dst_pages)[:tokens])
    prefill.pages_allocated(slots([src_page]))
    prefill.transfer_sent(rid, room, 0, sent_tokens, [src_page], True)
    prefill.transfer_done(rid, room, "sender", "success")
    decode.transfer_done(rid, room, "receiver", "success")
    last = dst_pages[-1] + 1
    decode.pages_allocated(slots([last]))
    decode.rows_assigned(rid, tokens, tokens + 1, tokens, [last * 4])
    decode.forward([rid], [tokens + 1], [[last * 4]], [slots(dst_pages + [last])[: tokens + 1]])
    return last


def finish(decode, rid, pages):
    decode.request_end(rid, "length", 1000, 2000, 1, "")
    decode.pages_freed(slots(pages))
