"""The trace-driven keep-alive simulator behind `ember sim`: trace readers, synthetic traces, engine, reports."""
