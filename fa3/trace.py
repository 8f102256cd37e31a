"""Per-tile clock stamps of the fa3 forward (`Fa3Config.trace`, a lab build, off in the table).

A timing table says how long a call takes; an ncu profile samples where resident warps wait.
Neither sees what happens between a CTA's exit and the next CTA's start on the same SM, nor
how a persistent CTA's tiles follow each other. With `trace` the dense 16-bit forward writes,
for each (tile, consumer warpgroup), the SM's `%clock64` at the points below into an int64
tensor (rows, len(FIELDS)) that the binary takes in descale_q's slot (16-bit builds have no
descales). Row = tile_id · NUM_CONSUMER_WGS + cwg, tile_id = m_block + m_blocks · (head +
heads_q · batch), so plain and persistent grids fill the same rows. `%clock64` counts the SM's
cycles: stamps compare within an SM (tiles of one SM, CTAs after each other), not across SMs.
`benchmarks/fa3_timeline.py` launches such builds and reads the rows.

Fields (the producer's two go into the row of consumer warpgroup 0):

    smid          the SM that ran the tile
    cta_start     the CTA's first stamp (kernel entry), the same for all tiles of a CTA
    tile_start    the consumer warpgroup starts the tile (registers set, before Q's wait)
    q_ready       Q (and with it the tile's start) waited for; the K/V loop follows
    loop_end      the last P·V retired (the main loop done; 0 Q wait and loop on a plain-grid
                  tile without a K/V block, whose q_ready stays 0)
    epilogue_end  O and the LSE handed to their stores (the store warp's wait included)
    load_start    the producer warp starts the tile's loads
    loads_issued  the producer warp has issued the tile's last load (it waited for free stages)
    cta_start_ns, epilogue_end_ns   %globaltimer (ns, one clock for every SM) at cta_start and
                  epilogue_end: what lines the SMs up (the tail of the last wave)
"""

# No `from __future__ import annotations` (the CuTe DSL reads annotations as objects), and no
# module-level import of the DSL: the field names serve readers on machines without it
# (benchmarks/fa3_timeline.py, its CPU tests); the functions run inside the kernel's trace.

FIELDS = (
    "smid",
    "cta_start",
    "tile_start",
    "q_ready",
    "loop_end",
    "epilogue_end",
    "load_start",
    "loads_issued",
    "cta_start_ns",
    "epilogue_end_ns",
)
SMID, CTA_START, TILE_START, Q_READY, LOOP_END, EPILOGUE_END, LOAD_START, LOADS_ISSUED = range(8)
CTA_START_NS, EPILOGUE_END_NS = 8, 9
CONSUMER_FIELDS = (
    SMID, CTA_START, TILE_START, Q_READY, LOOP_END, EPILOGUE_END, CTA_START_NS, EPILOGUE_END_NS
)  # fmt: skip


def tile_row(sched, m_block, head, batch, cwg, wgs: int):
    """The trace row of (tile, consumer warpgroup cwg) in a dense problem `sched`."""
    return (m_block + sched.m_blocks * (head + sched.heads_q * batch)) * wgs + cwg


def now():
    """The SM's %clock64 (cycles)."""
    import cutlass.cute as cute

    return cute.arch.clock64()


def now_ns():
    """%globaltimer (ns, one clock for every SM)."""
    import cutlass.cute as cute

    return cute.arch.globaltimer()


def write(trace, row, fields: tuple, values: tuple) -> None:
    """trace[row, f] = v for each pair, as int64 (one thread calls it)."""
    from cutlass import Int64

    for field, value in zip(fields, values, strict=True):
        trace[row, field] = Int64(value)
