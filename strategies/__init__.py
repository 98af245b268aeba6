"""graphfl.strategies"""
