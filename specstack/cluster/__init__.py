"""`specstack serve --replicas N`: the server's engine as Ray Serve replicas behind one endpoint (DESIGN §8).

deploy.py starts (or joins) Ray and deploys; replica.py is one replica (a whole engine, pinned to its
cores); board.py the actor where replicas publish their health and metrics; aggregate.py merges those
metrics; failover.py the proxy's middleware that keeps errors OpenAI-shaped and retries a request whose
replica died before it sent anything. Ray is imported only here, and only when replicas are asked for.
"""
