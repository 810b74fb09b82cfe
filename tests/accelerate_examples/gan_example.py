"""A GAN: generator and discriminator, each with its optimizer and schedule, in one
`accelerator.prepare` (in mixed order); `accumulate(generator, discriminator)`; the generator's
step freezes the discriminator and calls it unwrapped (pix2pix / CycleGAN style), and
`save_state` / `load_state` resume both models exactly."""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def flat(state):
    return [float(v) for name in sorted(state) for v in state[name].float().flatten()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--checkpoint-at", type=int, default=4, help="save after this many batches")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu, gradient_accumulation_steps=2, step_scheduler_with_optimizer=False
    )
    set_seed(5)
    real_points = torch.randn(48, 2) * 0.5 + torch.tensor([1.0, -1.0])
    loader = DataLoader(TensorDataset(real_points), batch_size=3, shuffle=False)
    generator = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    discriminator = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.05, momentum=0.5)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=3, gamma=0.5)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=4, gamma=0.7)
    discriminator, opt_g, generator, loader, opt_d, sched_d, sched_g = accelerator.prepare(
        discriminator, opt_g, generator, loader, opt_d, sched_d, sched_g
    )
    state_dir = os.path.join(args.out, "state")
    batches = 0
    if args.resume:
        accelerator.load_state(state_dir)
        batches = args.checkpoint_at
    start_epoch, skip = divmod(batches, len(loader))

    epochs = 2
    records = []
    for epoch in range(start_epoch, epochs):
        active = accelerator.skip_first_batches(loader, skip) if epoch == start_epoch and skip else loader
        for (real,) in active:
            noise = torch.Generator().manual_seed(1000 * accelerator.process_index + batches)
            z = torch.randn(real.shape[0], 3, generator=noise)
            with accelerator.accumulate(generator, discriminator):
                fake = generator(z)
                # discriminator step
                real_logits, fake_logits = discriminator(real), discriminator(fake.detach())
                d_loss = F.binary_cross_entropy_with_logits(
                    real_logits, torch.ones_like(real_logits)
                ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
                accelerator.backward(d_loss)
                opt_d.step()
                if accelerator.sync_gradients:
                    sched_d.step()
                opt_d.zero_grad()
                # generator step: the discriminator frozen, called unwrapped
                discriminator.requires_grad_(False)
                judged = accelerator.unwrap_model(discriminator)(fake)
                g_loss = F.binary_cross_entropy_with_logits(judged, torch.ones_like(judged))
                accelerator.backward(g_loss)
                opt_g.step()
                if accelerator.sync_gradients:
                    sched_g.step()
                opt_g.zero_grad()
                discriminator.requires_grad_(True)
            batches += 1
            pair = accelerator.gather(torch.stack([d_loss.detach(), g_loss.detach()])[None]).mean(dim=0)
            records.append([*pair.tolist(), sched_d.get_last_lr()[0], sched_g.get_last_lr()[0]])
            if not args.resume and batches == args.checkpoint_at:
                accelerator.save_state(state_dir)
    g_state = accelerator.get_state_dict(generator)
    d_state = accelerator.get_state_dict(discriminator)
    if accelerator.is_main_process:
        result = {
            "losses": [v for r in records for v in r[:2]],
            "lrs": [v for r in records for v in r[2:]],
            "generator": flat(g_state),
            "discriminator": flat(d_state),
        }
        Path(args.out, "resumed.json" if args.resume else "full.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
