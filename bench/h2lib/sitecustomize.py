"""On a filter's PYTHONPATH (``bench/h2_frame_layer.py``): its ext_proc server's connections run on
python-hyper's ``h2`` (``h2_connection.H2Connection``) instead of the filter's own frame layer."""

import os
import sys

if os.environ.get("DERENDER_FRAME_LAYER") == "h2":
    sys.path.insert(0, os.path.dirname(__file__))
    from derender.extproc.http2 import server as _server
    from h2_connection import H2Connection

    _server.Connection = H2Connection
