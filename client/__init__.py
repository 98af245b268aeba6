"""graphfl.client"""
