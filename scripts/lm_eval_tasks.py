"""Write two tiny lm-eval tasks and their data into a folder, for evaluating `branchspec
serve` offline (no data set download): `--include_path FOLDER --tasks branchspec_arith`
(multiple choice: lm-eval's loglikelihood requests, which /v1/completions answers with
echo and logprobs) and `branchspec_arith_chat` (generate_until, for --apply_chat_template).

The questions are one- and two-digit sums and differences in the GSM8K answer style the
embedded model was trained on, drawn with a fixed seed, so every run sees the same ones.

    python scripts/lm_eval_tasks.py /tmp/branchspec_tasks [--num 40]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

MC_TASK = """task: branchspec_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

CHAT_TASK = """task: branchspec_arith_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} Answer with the number only."
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: 0
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def questions(num: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        op = rng.choice("+-")
        answer = a + b if op == "+" else a - b
        wrong = sorted({answer + d for d in (-10, -2, -1, 1, 2, 10)} - {answer})
        choices = [str(answer), *map(str, rng.sample(wrong, 3))]
        rng.shuffle(choices)
        out.append({"question": f"What is {a} {op} {b}?", "choices": choices,
                    "label": choices.index(str(answer)), "answer": str(answer)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the task files and data into")
    parser.add_argument("--num", type=int, default=40, help="questions (default 40)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = (args.out / "arith.jsonl").resolve()
    data.write_text("".join(json.dumps(q) + "\n" for q in questions(args.num)))
    (args.out / "branchspec_arith.yaml").write_text(MC_TASK.format(data=data))
    (args.out / "branchspec_arith_chat.yaml").write_text(CHAT_TASK.format(data=data))
    print(f"wrote {args.num} questions and the tasks branchspec_arith, branchspec_arith_chat to {args.out}")


if __name__ == "__main__":
    main()
