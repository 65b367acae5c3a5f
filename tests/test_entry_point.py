"""``torch.compile(model, backend="rematc", options=...)`` in a fresh interpreter, with
no ``import rematc``: the backend is found through the ``torch_dynamo_backends`` entry
point of the installed package."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    assert "rematc" not in sys.modules
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 64), torch.nn.Tanh()]
    for _ in range(6):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))
    x = torch.randn(1024, 8)
    ref = model(x).square().mean(); ref.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="rematc",
                             options={"budget": "75%", "compiler": "eager"})
    loss = compiled(x).square().mean(); loss.backward()
    err = max((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), expected))
    import rematc
    record = rematc.records()[-1]
    print(json.dumps({"loss": loss.item(), "ref": ref.item(), "err": err,
                      "budget": record.budget, "peak": record.predicted_peak}))
    """
)


def test_backend_found_by_name_without_import() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(got["loss"] - got["ref"]) <= 1e-6
    assert got["err"] <= 1e-6
    assert got["peak"] <= got["budget"]
