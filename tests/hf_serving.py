"""What a model server does with an HF export: load it with plain transformers, in a process that imports no
project code, and generate greedily."""

import json
import subprocess
import sys
from pathlib import Path

PLAIN_TRANSFORMERS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, prompts, max_new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, use_safetensors=True).eval()
out = []
for prompt in prompts:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    out.append({"prompt": prompt, "ids": inputs["input_ids"][0].tolist(),
                "completion": tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)})
print(json.dumps(out))
"""


def generate_with_plain_transformers(folder: Path, prompts: list[str], max_new_tokens: int, cwd: Path) -> list[dict]:
    """[{prompt, ids (the prompt's token ids), completion}] as transformers generates them from `folder`."""
    proc = subprocess.run([sys.executable, "-c", PLAIN_TRANSFORMERS, str(folder), json.dumps(prompts),
                           str(max_new_tokens)], cwd=cwd, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
