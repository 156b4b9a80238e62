"""hypertrain's SLURM launcher: Hydra's submitit launcher with what hypertrain's runs need.

Selected by `conf/hydra/launcher/slurm.yaml` and `slurm_dist.yaml`; what it changes and why is in
`hypertrain/launchers/slurm.py`, which holds the code (imported only when a SLURM sweep runs: Hydra imports
this module at every start). Without hydra-submitit-launcher installed there is no launcher here.
"""

from __future__ import annotations

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
except ImportError:  # the dev extra is not installed: the SLURM presets are unavailable, nothing else
    SubmititSlurmLauncher = None

if SubmititSlurmLauncher is not None:

    class SlurmLauncher(SubmititSlurmLauncher):
        """Jobs run with resume=auto, the sweep directory pinned, and one writer per multi-task job;
        a failing sacct is reported once per sweep while the jobs are waited for; a submission sbatch
        refuses is one line, exit 2, nothing left."""

        def launch(self, job_overrides, initial_job_idx):
            from hypertrain.launchers import slurm

            with slurm.sacct_reported_once(), slurm.refused_submission(self.config):
                return super().launch(slurm.prepare_sweep(self.config, job_overrides), initial_job_idx)

        def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
            from hypertrain.launchers import slurm

            if slurm.writes_the_job():
                return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
            return slurm.run_silent_task(self, sweep_overrides, job_dir_key, job_num, singleton_state)
