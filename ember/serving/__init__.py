"""The serving core's actuation: runs requests and jobs down the ladder on a node, and keeps idle capacity."""
