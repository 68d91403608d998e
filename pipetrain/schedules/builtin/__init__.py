"""The built-in schedule families, one file each, registered in this order."""

from pipetrain.schedules.builtin import (
    gpipe,
    interleaved,
    one_f_one_b,
    pipedream,
    two_bw,
    zero_bubble,
)
from pipetrain.schedules.registry import register

for family in (gpipe, one_f_one_b, interleaved, zero_bubble, pipedream, two_bw):
    register(family.SPEC)
