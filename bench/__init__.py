"""graphfl.bench"""
