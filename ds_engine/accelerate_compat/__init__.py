"""accelerate's `Accelerator` surface over the Engine, one concern per module.

`compat` (what each accelerate name does here: `COMPAT`), `constructor` (accelerate's
constructor arguments -> Engine choices, a pure function), `views` (`accelerator.state`,
`state.deepspeed_plugin`), `state_folders` (`save_state` / `load_state` naming and rotation),
`trackers` (`log_with`, `init_trackers`) and `accelerator` (the `Accelerator` class, an
`Engine` that uses only the Engine's and the backend's declared interfaces).
``from ds_engine import Accelerator`` and ``ds_engine.accelerator`` re-export it.
"""
