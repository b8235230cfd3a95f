"""``python -m services.drafter --method lyanna --port N``: see ``services.drafter.server``."""

from services.drafter.server import main

raise SystemExit(main())
