"""What `ds_engine.Accelerator` does with each public name of `accelerate.Accelerator`.

`COMPAT` is the table ``scripts/tools/compat_table.py`` renders into
``docs/accelerate_compat.md``; `SEMANTICS_NOTE` is the line an Accelerator logs once when built.
Data only: nothing here imports the Engine.
"""

from __future__ import annotations

SUPPORTED, DIFFERS, NOT_APPLICABLE = "supported", "differs", "not applicable"

#: Every public name of `accelerate.Accelerator` (accelerate 1.16), classified for ds_engine's
#: `Accelerator`: (status, how). "supported": same name, same meaning. "differs": the name
#: exists and works, with the difference stated. "not applicable": ds_engine has no such
#: feature; the name is absent or raises with a hint. `tests/unit/test_accelerator_surface.py`
#: fails when accelerate gains a name that is not classified here, and when a name classified
#: as supported or differs stops existing.
COMPAT: dict[str, tuple[str, str]] = {
    "accumulate": (
        DIFFERS,
        "the Engine decides the boundary (every GA micro-steps and the loader's last batch) and divides "
        "each loss by its window's real length, also for a short last window; with several trained "
        "models, one micro-step of each (whichever models are named), so all share the windows",
    ),
    "autocast": (SUPPORTED, "autocast for the configured precision (DeepSpeed casts itself)"),
    "backward": (
        DIFFERS,
        "the loss is divided by the window length, not by GA; `num_items=` for a loss summed over "
        "tokens (the window's token mean, with `windows(loader)`); no other extra arguments; with "
        "several trained models it trains the one whose parameters the loss reaches (its graph walked "
        "once), and a loss reaching two trained models is refused naming both (freeze one for it)",
    ),
    "check_trigger": (SUPPORTED, ""),
    "clear": (SUPPORTED, "alias of `free_memory`"),
    "clip_grad_norm_": (
        DIFFERS,
        "`max_norm` must equal the config's `gradient_clipping` (DeepSpeed clips inside its step); "
        "only the 2-norm; acts at boundaries; on the model whose parameters are given",
    ),
    "clip_grad_value_": (
        SUPPORTED,
        "at boundaries, on the fallback; on DeepSpeed it raises, as accelerate does",
    ),
    "context_parallel_rank": (NOT_APPLICABLE, "no context parallelism"),
    "data_parallel_rank": (NOT_APPLICABLE, "no composable parallelism: use `process_index`"),
    "data_parallel_shard_rank": (NOT_APPLICABLE, "no composable parallelism: use `process_index`"),
    "deepspeed_plugin": (
        DIFFERS,
        "a view: `.deepspeed_config` (the final JSON after `prepare`, the configured blocks before), "
        "`.zero_stage`, `.hf_ds_config`; None on the fallback",
    ),
    "deepspeed_ulysses_dl_adapter": (NOT_APPLICABLE, "no sequence parallelism"),
    "device": (SUPPORTED, ""),
    "dispatch_batches": (
        SUPPORTED,
        "always False: every rank reads its loader; a stream (`IterableDataset`) is read by every rank, "
        "each keeping its slice of every global batch (docs/data_pipelines.md)",
    ),
    "distributed_type": (
        SUPPORTED,
        "DEEPSPEED on the DeepSpeed backend; accelerate's own value on the fallback (MULTI_CPU, "
        "MULTI_GPU, FSDP, NO)",
    ),
    "end_training": (SUPPORTED, "finishes the trackers, then a barrier and the process group's end"),
    "even_batches": (
        SUPPORTED,
        "always True: the last global batch is completed from the epoch start (a batch sampler's last "
        "round by its first whole batches)",
    ),
    "fp8_backend": (NOT_APPLICABLE, "no fp8"),
    "free_memory": (
        SUPPORTED,
        "drops the prepared objects (and the DeepSpeed engine) so `prepare` can run again",
    ),
    "gather": (SUPPORTED, ""),
    "gather_for_metrics": (
        SUPPORTED,
        "drops the samples padded into the last batch; `use_gather_object` too",
    ),
    "get_state_dict": (
        DIFFERS,
        "collective; the full dict on the main process, None on the others (ZeRO-3 gathered layer by "
        "layer); any prepared model",
    ),
    "get_tracker": (SUPPORTED, ""),
    "gradient_accumulation_steps": (DIFFERS, "read-only: set it in the constructor"),
    "init_trackers": (SUPPORTED, "accelerate's own tracker classes, on the main process"),
    "is_composable_parallelism_enabled": (SUPPORTED, "True only under the fallback's FSDP2"),
    "is_fsdp2": (SUPPORTED, "True only under the fallback's FSDP2 (ZeRO-2/3 on GPUs)"),
    "is_last_process": (SUPPORTED, ""),
    "is_local_main_process": (SUPPORTED, ""),
    "is_main_process": (SUPPORTED, ""),
    "join_uneven_inputs": (NOT_APPLICABLE, "batches are always even across ranks"),
    "load_state": (
        DIFFERS,
        "a folder written by `save_state` (ds_engine's checkpoint format, which also restores the "
        "dataloader position, and every trained model's state); automatic naming picks the newest "
        "complete `checkpoint_<i>`",
    ),
    "local_main_process_first": (SUPPORTED, ""),
    "local_process_index": (SUPPORTED, ""),
    "log": (SUPPORTED, "main process only"),
    "logging_dir": (SUPPORTED, ""),
    "lomo_backward": (NOT_APPLICABLE, "no LOMO optimizers"),
    "main_process_first": (SUPPORTED, ""),
    "maybe_context_parallel": (NOT_APPLICABLE, "no context parallelism"),
    "mixed_precision": (SUPPORTED, "'no', 'fp16' or 'bf16', from the resolved config"),
    "multi_device": (SUPPORTED, ""),
    "no_sync": (
        DIFFERS,
        "a no-op context: the Engine alone decides when gradients are reduced (once per optimizer "
        "step on DDP/ZeRO-0/1)",
    ),
    "non_blocking": (SUPPORTED, "batches are always moved with non_blocking=True"),
    "num_processes": (SUPPORTED, ""),
    "on_last_process": (SUPPORTED, ""),
    "on_local_main_process": (SUPPORTED, ""),
    "on_local_process": (SUPPORTED, ""),
    "on_main_process": (SUPPORTED, ""),
    "on_process": (SUPPORTED, ""),
    "optimizer_step_was_skipped": (
        SUPPORTED,
        "True when the last boundary's step was skipped (fp16 overflow, bf16 check, non-finite)",
    ),
    "pad_across_processes": (SUPPORTED, ""),
    "parallelism_config": (NOT_APPLICABLE, "no composable parallelism"),
    "pipeline_parallel_rank": (NOT_APPLICABLE, "no pipeline parallelism"),
    "prepare": (
        DIFFERS,
        "several models, optimizers and schedulers in any order (each optimizer goes with the model "
        "whose parameters it holds, each scheduler with its optimizer; a model without one is "
        "prepared for inference), one Engine per model sharing the process group (under DeepSpeed one "
        "DeepSpeed engine per trained model, same config; an inference model replicated under ZeRO-1/2, "
        "partitioned under ZeRO-3); with two trained models an epoch's batches must be a multiple of "
        "GA (docs/several_models.md); "
        "DummyOptim/DummyScheduler need the config's optimizer/scheduler block (DeepSpeed backend) "
        'and fill its "auto" values as accelerate does; '
        "the scheduler advances only for applied optimizer steps (never on skipped ones): "
        "`num_processes` times each when sized from the un-prepared loader (accelerate's way, "
        "the default reading), once with `step_scheduler_with_optimizer=False` or "
        '`schedule_sized_from = "prepared"`',
    ),
    "prepare_data_loader": (SUPPORTED, ""),
    "prepare_model": (NOT_APPLICABLE, "prepare the model with its optimizer: `prepare(model, optimizer)`"),
    "prepare_optimizer": (
        NOT_APPLICABLE,
        "prepare the optimizer with its model: `prepare(model, optimizer)`",
    ),
    "prepare_scheduler": (SUPPORTED, "after the model and optimizer were prepared"),
    "print": (SUPPORTED, ""),
    "process_index": (SUPPORTED, ""),
    "profile": (NOT_APPLICABLE, "use torch.profiler directly"),
    "project_dir": (SUPPORTED, ""),
    "reduce": (SUPPORTED, "accelerate's own `reduce` on the Engine's process group"),
    "register_for_checkpointing": (SUPPORTED, "their state dicts go into the checkpoint's client state"),
    "register_load_state_pre_hook": (NOT_APPLICABLE, "ds_engine's checkpoint format has no per-model hooks"),
    "register_save_state_pre_hook": (NOT_APPLICABLE, "ds_engine's checkpoint format has no per-model hooks"),
    "save": (SUPPORTED, "writes on the main process only"),
    "save_iteration": (SUPPORTED, ""),
    "save_model": (
        SUPPORTED,
        "consolidated weights (safetensors, sharded past `max_shard_size`) plus the model's config.json; "
        "any prepared model",
    ),
    "save_state": (
        DIFFERS,
        "ds_engine's checkpoint format in the folder (`<dir>/state/` and `<dir>/latest`); automatic "
        "naming and `total_limit` rotation as in accelerate, rotating only after the new save is "
        "complete; each model trained beside the first in `<dir>/model_<i>/` (accelerate's index); "
        "call it at a boundary",
    ),
    "set_trigger": (SUPPORTED, ""),
    "should_save_model": (SUPPORTED, "True on the local main process"),
    "skip_first_batches": (
        DIFFERS,
        "on a prepared loader it returns the same loader, whose next iteration starts at batch n "
        "(accumulation windows stay where they were)",
    ),
    "split_batches": (SUPPORTED, "always False: `batch_size` is per process"),
    "split_between_processes": (SUPPORTED, ""),
    "sync_gradients": (SUPPORTED, ""),
    "tensor_parallel_rank": (NOT_APPLICABLE, "no tensor parallelism"),
    "torch_device_mesh": (NOT_APPLICABLE, "no composable parallelism (no device mesh)"),
    "trigger_sync_in_backward": (
        NOT_APPLICABLE,
        "the Engine already reduces at every boundary; a forced sync is not needed",
    ),
    "unscale_gradients": (NOT_APPLICABLE, "the Engine unscales inside the optimizer step"),
    "unwrap_model": (SUPPORTED, "`keep_fp32_wrapper` / `keep_torch_compile` accepted; any prepared model"),
    "use_distributed": (SUPPORTED, ""),
    "use_seedable_sampler": (
        DIFFERS,
        "always False, accelerate's default: one generator seeded at prepare, continued across "
        "epochs, recorded in checkpoints; `DataLoaderConfiguration(use_seedable_sampler=True)` is "
        "accepted but its per-epoch reseeding is not followed (docs/data_pipelines.md)",
    ),
    "use_stateful_dataloader": (SUPPORTED, "always True: checkpoints hold the loader's position"),
    "verify_device_map": (SUPPORTED, ""),
    "wait_for_everyone": (SUPPORTED, ""),
}


#: Said once (main process, the "ds_engine" logger at INFO) when an Accelerator is built.
SEMANTICS_NOTE = (
    "ds_engine.Accelerator keeps ds_engine's semantics where they differ from accelerate's: "
    "gradients are reduced and applied only at accumulation boundaries (every GA micro-steps and "
    "the loader's last batch), a short last window is divided by its real length, and a skipped "
    "step (fp16 overflow, non-finite gradients) advances neither the optimizer nor the LR "
    "scheduler. Every difference: docs/accelerate_compat.md"
)
