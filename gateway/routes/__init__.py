"""The gateway's HTTP and WebSocket routes, one module per API; each has an ``add_*_routes(app)``
that gateway/app.py calls. They reach the app's state through gateway/app_keys.py."""
