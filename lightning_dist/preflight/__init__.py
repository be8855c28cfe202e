"""Checks of the launch environment (SLURM variables, MPI launchers), made before any process group."""
