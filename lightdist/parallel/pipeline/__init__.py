"""Pipeline parallelism: stages cut by the model's structure (``structural``) or, where it has no block list, by
torch's tracer (``traced``); the schedules that run them (``schedules``); the weights tied across the pipeline's ends
(``tied``). ``lightdist.plugins.pipeline_step`` runs a LightningModule's step as a schedule's loss."""
