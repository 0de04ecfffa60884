"""One-shot generation: prompts in, completions out, without a daemon.

It sits above both the scheduler and the engine: ``batch.py`` drives a
scheduler over any executor (the engine, or the simulated one), and
``generate.py`` builds the engine for ``kvd generate``."""
