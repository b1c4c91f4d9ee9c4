"""An agent's tool-calling loop through the `openai` client against `specstack serve` on the real pair
(issue 35's goal): the model is given two tools and a question; it calls a tool (tool_choice auto: the
model decides), the call is run here, its result goes back as a `role: "tool"` message, and the model
answers. The first question's call is asked whole, the second's streamed (its deltas put together as a
client does); both answers are streamed; the run prints each turn and the server's speculation counters.

    python benchmarks/structured/agent_round_trip.py [--model qwen2.5-coder-1.5b] [--port 8093]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx
from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "source": {"type": "string"},
                                                        "target": {"type": "string"}},
                       "required": ["amount", "source", "target"]}}},
]


# as agent frameworks write one: without it the 1.5B repeats its call after the result instead of answering
SYSTEM = ("You are a helpful assistant. Call a tool when you need data; once its result is given, answer the user "
          "in one sentence.")


def turn(client: OpenAI, model: str, messages: list[dict], stream: bool) -> tuple[list[dict], str, str | None]:
    """One assistant turn with the tools offered (tool_choice auto): (its calls, its text, finish reason);
    streamed, the calls are put together from their deltas as a client does."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=128)
        msg = r.choices[0].message
        return ([{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []],
                msg.content or "", r.choices[0].finish_reason)
    calls: dict[int, dict] = {}
    text, reason = "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=128, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], text, reason


def run_tool(name: str, args: dict) -> dict:
    if name == "get_weather":
        return {"city": args.get("city"), "temperature": 18, "unit": args.get("unit", "celsius"), "sky": "clear"}
    if name == "convert_currency":
        return {"amount": round(float(args["amount"]) * 0.92, 2), "currency": args["target"]}
    return {"error": f"no tool {name}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--port", type=int, default=8093)
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "specstack.cli", "serve", "--model", args.model, "--port",
                               str(args.port), "--max-batch", "2"], env={**os.environ})  # its log: our stderr
    try:
        base = f"http://127.0.0.1:{args.port}"
        for _ in range(600):
            if server.poll() is not None:
                print(f"the server exited ({server.returncode}) before it was ready", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        client = OpenAI(base_url=base + "/v1", api_key="none")
        ok = True
        for k, question in enumerate(("What is the weather in Oslo right now?", "How much is 250 US dollars in euros?")):
            messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            t0 = time.perf_counter()
            calls, content, reason = turn(client, args.model, messages, stream=k == 1)
            print(f"user: {question}\n  finish {reason}, {time.perf_counter() - t0:.1f} s"
                  f"{', streamed' if k == 1 else ''}, calls: {[(c['name'], c['arguments']) for c in calls]}")
            if not calls:
                print(f"  no call; text: {content!r}")
                ok = False
                continue
            messages.append({"role": "assistant", "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]})
            for c in calls:
                result = run_tool(c["name"], json.loads(c["arguments"]))
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": json.dumps(result)})
            t0 = time.perf_counter()
            again, answer, reason = turn(client, args.model, messages, stream=True)
            print(f"  tool results sent; answer ({time.perf_counter() - t0:.1f} s, streamed, finish {reason}): "
                  f"{answer!r}{'; called again: ' + str(again) if again else ''}")
            ok = ok and bool(answer.strip()) and not again
        metrics = httpx.get(base + "/metrics").text
        print("\n".join(line for line in metrics.splitlines() if line.startswith("specstack:generation_tokens_by_origin")))
        print("round trip:", "ok" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
