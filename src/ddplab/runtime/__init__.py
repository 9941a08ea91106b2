"""Where ddplab meets torch.distributed: launching ranks, signals, spec files, data order, rank failures."""
