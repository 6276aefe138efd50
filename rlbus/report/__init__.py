"""A run's report (`report.md`) and plots, from its run store; `plots` also draws the
launcher's `reward_curve.png`."""
