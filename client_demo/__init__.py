"""The browser demo page (web/), served at / by the server. The Python client is the voicelane_client package."""
