"""graphfl.p2p"""
