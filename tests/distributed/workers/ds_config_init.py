"""Worker: the builder's config for ZeRO stages 0-3 initializes real DeepSpeed and trains one step.

Run by tests/distributed/test_ds_config_init.py on 2 CPU ranks (gloo); all four stages run
sequentially in the same process group.
"""

from __future__ import annotations

import torch
from _common import parse_args, rank, write_result


def main() -> None:
    args = parse_args()
    import deepspeed
    import torch.distributed as dist

    from ds_engine.config import EngineConfig
    from ds_engine.ds_config import build_ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    micro, ga, hidden = 2, 1, 16
    result: dict = {"world_size": world, "stages": {}}
    for stage in range(4):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = EngineConfig(zero_stage=stage, gradient_accumulation_steps=ga, gradient_clipping=1.0)
        ds_config = build_ds_config(cfg, world_size=world, micro_batch_size=micro, hidden_size=hidden)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        gen = torch.Generator().manual_seed(100 + rank())  # each rank its own data shard
        x, y = torch.randn(micro, 8, generator=gen), torch.randn(micro, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        with torch.no_grad():
            after = torch.nn.functional.mse_loss(engine(x), y)
        result["stages"][str(stage)] = {
            "ds_config": ds_config,
            "zero_stage": engine.zero_optimization_stage(),
            "train_batch_size": engine.train_batch_size(),
            "gradient_clipping": engine.gradient_clipping(),
            "global_steps": engine.global_steps,
            "loss_before": loss.item(),
            "loss_after": after.item(),
        }
        engine.destroy()
        dist.barrier()
    write_result(args.out, result)


if __name__ == "__main__":
    main()
