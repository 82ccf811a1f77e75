"""``python -m advisor.cluster``: run one advisor of a cluster (:func:`advisor.cluster.node.main`)."""

from advisor.cluster.node import main

raise SystemExit(main())
