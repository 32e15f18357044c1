"""eyas"""
