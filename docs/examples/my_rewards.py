"""An example user reward function for docs/examples/own_model.yaml (`function: "my_rewards:brevity"`).

A function term is `fn(prompt, response, answer, metadata) -> float`, called on the GenRM ranks once per
sample (with `batched: true`: once per scored batch, with lists, returning a list). `metadata` holds
the row's other columns plus `sample_id`, `prompt_id`, `owner`, `response_tokens` and `finish`. An
exception stops the run with the row and the traceback: it is never scored as 0.
"""


def brevity(prompt: str, response: str, answer: str, metadata: dict) -> float:
    """1 for answers up to 512 tokens, falling to 0 at 2048; a truncated response gets 0."""
    if metadata["finish"] == "length":
        return 0.0
    return max(0.0, min(1.0, (2048 - metadata["response_tokens"]) / (2048 - 512)))
