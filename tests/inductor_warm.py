"""Imported by the tests' fork server (dist_utils): inductor's choice of CPU vector instructions, which compiles
and runs probe programs once per process (1-9 s), is made there once, so the ranks that compile blocks inherit it.
Only a head start: a machine where the probe fails (no C++ compiler) leaves it to the ranks."""

try:
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()
except Exception:  # noqa: BLE001 - the ranks make the same choice themselves and report what fails
    pass
