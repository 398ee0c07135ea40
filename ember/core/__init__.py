"""The pure core: states, the ladder, scheduling and scaling decisions, with no I/O and no clock of its own."""
