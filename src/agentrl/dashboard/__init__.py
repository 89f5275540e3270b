"""`agentrl dashboard`: read-only web pages and a JSON API over every AgentRL run on a MongoDB server.

``queries`` reads the store (projections, indexes, pagination), ``tokens`` builds a trajectory's token view,
``charts`` draws the learning curves as SVG, ``hosts`` says which ``Host`` names a dashboard without a token
answers to, ``app`` serves pages and ``/api``. Only ``agentrl.cli`` imports this package.
"""
