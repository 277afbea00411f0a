"""``python -m radixmesh``: the ``radixmesh`` command, for trees used without installing."""

from radixmesh.cli import main

raise SystemExit(main())
