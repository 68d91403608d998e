"""The built-in schedule families, one file each, registered in this order."""

from pipetrain.schedules.builtin import (
    dualpipev,
    gpipe,
    interleaved,
    interleaved_zb,
    looped_bfs,
    one_f_one_b,
    pipedream,
    roundpipe,
    two_bw,
    v_half,
    v_min,
    zb_v,
    zero_bubble,
)
from pipetrain.schedules.registry import register

for family in (
    gpipe,
    one_f_one_b,
    interleaved,
    zero_bubble,
    pipedream,
    two_bw,
    looped_bfs,
    interleaved_zb,
    zb_v,
    v_half,
    v_min,
    dualpipev,
    roundpipe,
):
    register(family.SPEC)
