"""An agent's tool-calling loop through the `openai` client against `specstack serve` on the real pair
(issue 35's goal): the model is given two tools and a question; it calls a tool (tool_choice auto: the
model decides), the call is run here, its result goes back as a `role: "tool"` message, and the model
answers. Streamed and whole; the run prints each turn and the server's speculation counters.

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
    server = subprocess.Popen([sys.executable, "-m", "specstack", "serve", "--model", args.model, "--port",
                               str(args.port), "--max-batch", "2"], stderr=subprocess.PIPE, text=True,
                              env={**os.environ})
    try:
        base = f"http://127.0.0.1:{args.port}"
        for _ in range(600):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        client = OpenAI(base_url=base + "/v1", api_key="none")
        ok = True
        for question in ("What is the weather in Oslo right now?", "How much is 250 US dollars in euros?"):
            messages: list[dict] = [{"role": "user", "content": question}]
            t0 = time.perf_counter()
            first = client.chat.completions.create(model=args.model, messages=messages, tools=TOOLS, temperature=0,
                                                   max_tokens=128)
            msg = first.choices[0].message
            print(f"user: {question}\n  finish {first.choices[0].finish_reason}, "
                  f"{time.perf_counter() - t0:.1f} s, calls: {[(c.function.name, c.function.arguments) for c in msg.tool_calls or []]}")
            if not msg.tool_calls:
                print(f"  no call; text: {msg.content!r}")
                ok = False
                continue
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                result = run_tool(call.function.name, json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
            t0 = time.perf_counter()
            stream = client.chat.completions.create(model=args.model, messages=messages, tools=TOOLS, temperature=0,
                                                    max_tokens=96, stream=True)
            answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            print(f"  tool results sent; answer ({time.perf_counter() - t0:.1f} s, streamed): {answer!r}")
            ok = ok and bool(answer.strip())
        metrics = httpx.get(base + "/metrics").text
        print("\n".join(line for line in metrics.splitlines() if line.startswith("specstack:generation_tokens_by_origin")))
        print("round trip:", "ok" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
