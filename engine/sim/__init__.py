"""A scheduler simulator: the real Scheduler and EngineCore on a simulated GPU whose step times come from a
measured stage profile, fed by simulated clients (docs/engine.md, "The simulator"). Plain Python and numpy."""
