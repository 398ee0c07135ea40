"""The node: real processes (zygotes, templates, instances) that host models on this machine."""
