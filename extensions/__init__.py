"""Code of one's own that plugs into fedguard from outside its packages (``server.plugins``), tested."""
