"""Which workers take a request: the route's data, the fleet as one request sees it, the router and its policies."""
