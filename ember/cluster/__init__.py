"""Many machines on Ray: a controller actor, a node agent per machine, and gateways that route across nodes."""
