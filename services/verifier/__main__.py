"""``python -m services.verifier --model DIR --port N``: see ``services.verifier.server``."""

from services.verifier.server import main

raise SystemExit(main())
