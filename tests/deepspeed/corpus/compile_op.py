"""DeepSpeed's first initialisation on a machine compiles its CPU communication op (then cached): run once."""

import deepspeed
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="gloo")
dist.barrier()
dist.destroy_process_group()
