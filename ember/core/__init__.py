"""The pure core: what the serving path decides (states, placement on the ladder, the idle-capacity lifecycle,
scheduling and scaling), with no I/O and no clock of its own."""
