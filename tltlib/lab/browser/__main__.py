"""``python -m tltlib.lab.browser NOTEBOOK ...``: the browser tier as a script (:func:`tltlib.lab.browser.run.main`)."""
import sys

from .run import main

if __name__ == "__main__":                            # importing this module (pkgutil.walk_packages) runs nothing
    sys.exit(main())
