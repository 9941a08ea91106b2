"""A plain loop started by torchrun that never joins the process group: each process trains alone."""

import _data
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
model = _data.model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(_data.dataset(), batch_size=16, shuffle=True)
for x, y in loader:
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
print("alone-done", flush=True)
