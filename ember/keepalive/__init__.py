"""Keep-alive: what a model's idle capacity holds between requests (idle plans, the policies that make them, the
idle-time forecasts they read, the ladder's cells), pure like `ember.core` and run alike by the server and the
simulator."""
