"""run_benchmark: the stage (`stage`), its tables and plots (`report`) and why a setting is slow (`diagnose`)."""
