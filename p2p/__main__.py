"""``python -m graphfl.p2p peer|p2p ...`` (the same commands as ``graphfl peer`` / ``graphfl p2p``)."""

from graphfl.p2p.cli import make_app

if __name__ == "__main__":
    make_app()()
