"""The reference the engine tests hold vLLM's hidden-states extraction to: the protocol and file format of
``lightning_eagle.serving.extract_worker``, computed by Hugging Face transformers from the same checkpoint folder.
Runs in the engine venv (transformers is there; never imported by the test process)::

    python hf_reference_worker.py CONFIG.json

``CONFIG.json``: ``model``, ``aux_ids`` (vLLM's numbering, ascending, unique), ``storage``, ``dtype``, ``env``; the
vLLM-only fields are ignored. Numbering, as vLLM's ``extract_hidden_states`` means it: id 0 = the embeddings, id k
(0 < k < L) = Hugging Face's ``hidden_states[k]`` (the output of decoder layer k - 1), id L = ``num_hidden_layers`` =
the final hidden BEFORE the final norm (Hugging Face's ``hidden_states[L]`` is after it: taken here as the input of
``model.model.norm``). Per prompt it writes ``{storage}/hf-{n}.safetensors`` with ``hidden_states [T, n_ids, H]``
(columns in ascending id order, the requested dtype) and ``token_ids [T]`` (int64), and answers the paths.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MARKER = "LIGHTNING_EAGLE_EXTRACT "


def send(channel, message: dict) -> None:
    channel.write(MARKER + json.dumps(message) + "\n")
    channel.flush()


def check_aux_ids(aux_ids) -> list[int]:
    if not isinstance(aux_ids, list) or not aux_ids or not all(isinstance(i, int) and i >= 0 for i in aux_ids):
        raise ValueError(f"aux_ids must be a non-empty list of non-negative layer ids, got {aux_ids!r}")
    if len(set(aux_ids)) != len(aux_ids):
        raise ValueError(f"aux_ids {aux_ids} list an id more than once")
    if aux_ids != sorted(aux_ids):
        raise ValueError(f"aux_ids {aux_ids} are not ascending")
    return aux_ids


class Reference:
    def __init__(self, config: dict):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        torch.set_num_threads(1)  # a tiny model, beside a vLLM engine on the same cores
        self.aux_ids = check_aux_ids(config["aux_ids"])
        self.dtype = getattr(torch, config["dtype"])
        self.storage = Path(config["storage"]).resolve()
        self.storage.mkdir(parents=True, exist_ok=True)
        self.model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=self.dtype).eval()
        self.num_layers = self.model.config.get_text_config().num_hidden_layers
        if self.aux_ids[-1] > self.num_layers:
            raise ValueError(f"aux id {self.aux_ids[-1]} > num_hidden_layers = {self.num_layers}")
        self.pre_norm = None
        self.model.model.norm.register_forward_pre_hook(self._keep_pre_norm)
        self.count = 0

    def _keep_pre_norm(self, module, args) -> None:
        self.pre_norm = args[0]

    def extract(self, prompt: list[int]) -> str:
        torch = self.torch
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        assert len(out.hidden_states) == self.num_layers + 1
        columns = [self.pre_norm[0] if i == self.num_layers else out.hidden_states[i][0] for i in self.aux_ids]
        from safetensors.torch import save_file

        path = self.storage / f"hf-{self.count}.safetensors"
        self.count += 1
        tensors = {
            "hidden_states": torch.stack(columns, dim=1).to(self.dtype).contiguous(),
            "token_ids": torch.tensor(prompt, dtype=torch.int64),
        }
        save_file(tensors, str(path))
        return str(path)


def main(argv: list[str]) -> int:
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr
    try:
        config = json.loads(Path(argv[0]).read_text())
        env = {k: str(v) for k, v in (config.get("env") or {}).items()}
        os.environ.update(env)
        reference = Reference(config)
    except Exception as error:  # noqa: BLE001
        send(channel, {"error": f"{type(error).__name__}: {error}"})
        return 1
    import transformers

    send(
        channel,
        {"ready": True, "transformers": transformers.__version__, "aux_ids": reference.aux_ids, "env": env},
    )
    for line in sys.stdin:
        if not line.strip():
            break
        try:
            send(channel, {"paths": [reference.extract(p) for p in json.loads(line)["prompts"]]})
        except Exception as error:  # noqa: BLE001
            send(channel, {"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
