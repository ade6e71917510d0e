"""A run's config and pre-flight: the config sections composed (config.py, sft_config.py) and their help,
the checks that span sections (check_config.py), the run plan (run_plan.py: everything derived once), the roles
and their placement on pools, the training modes' registry (modes.py), and the run directory's checks."""
