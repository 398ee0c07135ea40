"""Node environments: virtualenvs built once per node from a requirements list ember ships, for runtimes whose
libraries cannot share ember's own (vLLM pins its own torch); their interpreter runs those models' processes."""
